"""Set-up tooling (model provisioning); not imported by the serving path."""
