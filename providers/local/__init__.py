"""The local provider: sandboxes as bubblewrap-isolated process groups on this host
(:mod:`.provider`), with their supervisors (:mod:`.supervisor`, :mod:`.spawner`), isolation
(:mod:`.isolation`), limits (:mod:`.limits`), processes (:mod:`.processes`) and file transfer
(:mod:`.files`), and its tour (:mod:`.demo`)."""
