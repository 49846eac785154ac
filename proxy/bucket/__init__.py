"""The shared tier of a cluster of replicas: an S3-compatible bucket behind every replica's own
disk, its catalogue in SQL, and the leases that name one replica for a cluster-wide job."""
