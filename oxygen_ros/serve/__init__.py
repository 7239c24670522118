"""The engine over openpi's websocket policy protocol (issue #23; docs/openpi.md).

protocol.py (msgpack-numpy), layouts.py (openpi keys per robot config -> Observation), clients.py (clients as
robots of one engine; chunks back to the observation they came from), server.py (the websocket server),
cli.py (`oxygen_serve`, `python -m oxygen_ros.serve`), eval_openpi.py (`python -m oxygen_ros.eval --openpi`),
bench_openpi.py (`python -m oxygen_ros.bench --openpi-clients ...`).
"""
