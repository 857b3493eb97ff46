"""Host work of requests in worker processes: the pool (`pool`) and what runs in it (`jobs`)."""
