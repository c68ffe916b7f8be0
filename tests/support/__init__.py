"""What the tests share, imported as ``support.<module>`` (``tests/`` is on the path: pytest puts
it there, and pyproject's ``pythonpath`` says so): ``models`` (tiny random models and their GGUF
twins), ``engines`` (dry-run engines, block-manager steps, a runner driven without the engine),
``servers`` (what the serving tests agree on; the server process itself is
``nanokv_cli.serve.process.ServerProcess``), ``cli`` (a CLI run under memory limits),
``kernels`` (packed layers of the CPU kernels) and ``browser`` (an HTML page in headless
Chromium, network off). Fixtures are in ``tests/conftest.py``."""
