"""The mesh's processes, in one home: what to start (launcher.MeshSpec, from the config), starting them with free
ports, health and mutual TLS (launcher.Mesh), restarting with backoff, scaling and draining (supervisor: the
Supervisor gRPC service the local actuator drives), and `meshserve up` itself (up.py). The services below know
nothing of it: each is a process that reads its config and serves."""
