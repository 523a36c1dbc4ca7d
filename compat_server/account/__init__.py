"""What a key can see of its own account: the RestClient / AdminClient account operations and the dashboard's
figures."""
