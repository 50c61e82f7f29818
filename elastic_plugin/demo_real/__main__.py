"""``python -m elastic_plugin.demo_real``: see :mod:`elastic_plugin.demo_real.pipeline`."""

from elastic_plugin.demo_real.pipeline import main

raise SystemExit(main())
