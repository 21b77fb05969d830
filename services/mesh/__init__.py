"""The mesh's processes, in one home: what to start (launcher.MeshSpec, from the config), starting them with free
ports, health and mutual TLS (launcher.Mesh), restarting with backoff, scaling and draining (supervisor: the
Supervisor gRPC service the local actuator drives), the actuators the autoscaler scales through (actuators.py:
local, Docker Compose, Kubernetes), and `meshserve up` itself (up.py). The services below know
nothing of it but the autoscaler, which drives an actuator: each is a process that reads its config and serves."""
