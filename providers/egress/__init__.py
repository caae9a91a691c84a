"""corral's egress: what ``allowed_hosts`` entries mean (:mod:`.rules`), the egress proxy a
sandbox goes out through (:mod:`.proxy`, standard library only, run as a script) and how the
providers that run it configure and start it (:mod:`.plan`)."""
