"""The pair transport under vLLM: the rendezvous store that owns the key layout, incarnations and the pair
handshake (:mod:`.store`), the links built from pairs (:mod:`.pairs`), and rejoin (:mod:`.rejoin`)."""
