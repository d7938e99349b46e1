"""How the platform reaches engines: in-process, or ``loramux engine`` processes over HTTP.

Everything above this package talks to ``PlatformContext.engine``, an engine client
(:class:`~loramux.platform.engine_fleet.client.EngineClient`): :class:`LocalEngine` runs the
engine in the platform's process (the embedded default); :class:`RoutedEngines` sends each
request to one of the engine processes registered in Redis, preferring the one that holds
its adapter (``routing``). ``server`` is the engine process's internal API and heartbeat.
"""
