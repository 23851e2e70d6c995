data "aws_partition" "current" {}

locals {
  # Node-template hints so that the cluster autoscaler can scale this pool up from zero
  # (it cannot inspect a node that does not exist yet). Keep in sync with labels/taint below.
  autoscaler_tags = {
    "k8s.io/cluster-autoscaler/node-template/label/rlhf/role"          = var.role
    "k8s.io/cluster-autoscaler/node-template/taint/nvidia.com/gpu"     = "true:NoSchedule"
    "k8s.io/cluster-autoscaler/node-template/resources/nvidia.com/gpu" = tostring(var.gpus_per_node)
  }
}

data "aws_iam_policy_document" "node_assume" {
  statement {
    actions = ["sts:AssumeRole"]

    principals {
      type        = "Service"
      identifiers = ["ec2.amazonaws.com"]
    }
  }
}

resource "aws_iam_role" "node" {
  name_prefix        = "${substr("${var.cluster_name}-${var.name}", 0, 30)}-"
  assume_role_policy = data.aws_iam_policy_document.node_assume.json
  tags               = var.tags
}

resource "aws_iam_role_policy_attachment" "node" {
  for_each = toset([
    "AmazonEKSWorkerNodePolicy",
    "AmazonEKS_CNI_Policy",
    "AmazonEC2ContainerRegistryReadOnly",
  ])
  role       = aws_iam_role.node.name
  policy_arn = "arn:${data.aws_partition.current.partition}:iam::aws:policy/${each.value}"
}

resource "aws_eks_node_group" "this" {
  cluster_name    = var.cluster_name
  node_group_name = var.name
  node_role_arn   = aws_iam_role.node.arn
  subnet_ids      = var.subnet_ids
  ami_type        = var.ami_type
  capacity_type   = var.capacity_type
  instance_types  = var.instance_types
  disk_size       = var.disk_size_gb

  scaling_config {
    min_size     = var.min_size
    max_size     = var.max_size
    desired_size = var.desired_size
  }

  update_config {
    max_unavailable = 1
  }

  # rlhf/role comes last so extra_labels cannot override it. The Prefect job templates select on it.
  labels = merge(var.extra_labels, { "rlhf/role" = var.role })

  # Only pods that tolerate the GPU taint (the Prefect job template adds the toleration) land here.
  taint {
    key    = "nvidia.com/gpu"
    value  = "true"
    effect = "NO_SCHEDULE"
  }

  tags = merge(var.tags, { "rlhf/role" = var.role })

  lifecycle {
    ignore_changes = [scaling_config[0].desired_size]

    precondition {
      condition     = var.min_size <= var.desired_size && var.desired_size <= var.max_size
      error_message = "Need min_size <= desired_size <= max_size."
    }
  }

  depends_on = [aws_iam_role_policy_attachment.node]
}

# Managed node groups do not propagate their tags to the Auto Scaling group; add the
# autoscaler node-template tags there explicitly.
resource "aws_autoscaling_group_tag" "autoscaler" {
  for_each               = local.autoscaler_tags
  autoscaling_group_name = aws_eks_node_group.this.resources[0].autoscaling_groups[0].name

  tag {
    key                 = each.key
    value               = each.value
    propagate_at_launch = false
  }
}
