from llmcore.cli import main

raise SystemExit(main())
