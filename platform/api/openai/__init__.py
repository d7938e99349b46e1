"""What the OpenAI-compatible APIs share: their request schemas (``schemas``), the
checks and conversions of OpenAI's fields (``params``, ``structured``), the renders of
completions and chat (``render``), and ``respond``, which runs a job and answers with JSON
or server-sent events. Each API's routes are in a package of its own (``completions``,
``chat``, ``responses``, ``models``)."""
