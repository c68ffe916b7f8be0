"""The ``nanokv`` commands, one module each; ``nanokv_cli.cli`` puts them on the app.

Each command parses its flags, calls what does the work (the driver, ``replay``, ``serve``,
``advise``, ``trace``) and prints the result. The flags several commands share are declared
once: the engine's in ``EngineConfig`` (``engine_options``), the rest in ``options``.
"""
