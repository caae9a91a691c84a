"""Protocol-level stand-ins for services these machines cannot reach (a Kubernetes API
server, E2B's, Daytona's and Modal's clouds, Vercel's Sandbox API). Each serves the part of
the real API that corral's providers use, on a free loopback port, keeps state, answers with
the real status codes and error bodies, and can be told to fail."""
