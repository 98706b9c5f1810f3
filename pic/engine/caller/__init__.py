"""The engine's caller side: what runs in the threads of its callers (``PIC`` with its compile, chat and run methods,
``Linked``, the stepper, the store's view). It reaches the core only through the command channel
(``pic.engine.commands``), which ``pic.engine.core.build.start_core`` returns."""
