from kapc.cli import main

main()
