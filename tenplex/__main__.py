from tenplex.cli import main

raise SystemExit(main())
