from gpuflex.console import main

main()
