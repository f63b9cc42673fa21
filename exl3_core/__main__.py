from __future__ import annotations

import sys

from exl3_core.cli import main

sys.exit(main())
