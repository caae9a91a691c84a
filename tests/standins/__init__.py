"""Protocol-level stand-ins for services these machines cannot reach (a Kubernetes API
server, E2B's and Daytona's clouds). Each serves the part of the real HTTP API that corral's
providers use, on a free loopback port, keeps state, answers with the real status codes and
error bodies, and can be told to fail."""
