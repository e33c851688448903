from gpuflex.cli import main

main()
