"""``python -m pdserve.kernels [--rebuild] [-v]``: build the CPU kernels ahead of time
(scripts/install.sh does)."""

from pdserve.kernels import main

raise SystemExit(main())
