"""Facts that more than one of splitserve's parts needs (the worker serves them, the router,
connector, benchmark and simulator read them). Modules here import nothing else of splitserve,
so every part may import them without depending on another part."""
