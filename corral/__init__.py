"""corral: dispatch AI-agent and CI work items to execution sandboxes."""
