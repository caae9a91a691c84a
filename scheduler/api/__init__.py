"""The ``corral api`` process: the HTTP api (dispatch, runner protocol, sessions, bundles, the
admin api and the web console), its limits, and the server that runs it. Nothing of the
intake or the workers imports it."""
