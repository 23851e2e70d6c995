terraform {
  required_version = ">= 1.5.0, < 2.0.0"

  required_providers {
    aws = {
      source  = "hashicorp/aws"
      version = "~> 5.70"
    }
    tls = {
      source  = "hashicorp/tls"
      version = "~> 4.0"
    }
    kubernetes = {
      source  = "hashicorp/kubernetes"
      version = "~> 2.33"
    }
    helm = {
      source  = "hashicorp/helm"
      version = "~> 3.0"
    }
    prefect = {
      source  = "PrefectHQ/prefect"
      version = "~> 2.0"
    }
  }

  # Configure remote state per team, e.g.:
  # backend "s3" {
  #   bucket       = "my-tf-state"
  #   key          = "rlhf-flows/dev/terraform.tfstate"
  #   region       = "us-east-1"
  #   use_lockfile = true
  #   encrypt      = true
  # }
}
