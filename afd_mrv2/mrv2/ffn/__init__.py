"""The FFN side of AFD in vLLM: the role process (:mod:`.role`), the server (:mod:`.server`) and its
executor loop (:mod:`.loop`), the session report (:mod:`.report`) and the role-leader watch (:mod:`.leader`)."""
