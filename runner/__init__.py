"""The runner that works inside a sandbox. Standard library only, so it runs in any image
with Python 3: it registers with the control plane, claims its work item and runs it."""
