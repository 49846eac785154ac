"""Where artifacts come from: a debuginfod server over HTTP, a local directory, the policy that
asks them (in order or racing) and the circuit breaker."""
