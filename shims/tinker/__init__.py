"""The Tinker wire: TensorData ↔ arrays and the training and sampling request / response bodies ↔ typed jobs."""
