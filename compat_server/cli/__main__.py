from compat_server.cli.main import main

main()
