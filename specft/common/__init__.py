"""What every layer may use: errors, registries, paths, locks, the run dir's config,
progress bars, disk sizes, logging, interrupts, launching ranks and their rendezvous."""
