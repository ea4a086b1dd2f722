"""`python -m ghostgpu.cli ...`: the `ghostgpu` command without its console script."""

from ghostgpu.cli.main import main

raise SystemExit(main())
