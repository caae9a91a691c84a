"""The docker provider: a container per sandbox (:mod:`.provider`) and its bounded exec and
copy streams (:mod:`.streams`). Importing this package loads no SDK: the provider module does."""
