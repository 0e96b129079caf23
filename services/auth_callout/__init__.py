"""`skiff auth-callout`: NATS auth callout that admits pods by their Kubernetes service-account
tokens (TokenReview) and gives each the NATS permissions of its role and own id."""
