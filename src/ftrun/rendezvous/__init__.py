"""Multi-node rendezvous: pure rules (:mod:`ftrun.rendezvous.state`) and, later, their driver."""
