"""The driver's control loop: the step as a pipeline of stages over actor groups (``loop.Runtime``)."""
