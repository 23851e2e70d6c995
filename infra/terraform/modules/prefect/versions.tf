terraform {
  required_version = ">= 1.5.0, < 2.0.0"

  required_providers {
    prefect = {
      source  = "PrefectHQ/prefect"
      version = "~> 2.0"
    }
  }
}
