from corral.cli import main

main()
