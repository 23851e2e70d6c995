output "vpc_id" {
  description = "ID of the VPC."
  value       = aws_vpc.this.id
}

output "vpc_cidr_block" {
  description = "IPv4 CIDR of the VPC."
  value       = aws_vpc.this.cidr_block
}

output "private_subnet_ids" {
  description = "IDs of the private subnets (EKS control-plane ENIs and nodes)."
  value       = aws_subnet.private[*].id
}

output "public_subnet_ids" {
  description = "IDs of the public subnets (NAT gateways, internet-facing load balancers)."
  value       = aws_subnet.public[*].id
}

output "nat_gateway_public_ips" {
  description = "Public IPs of the NAT gateways (egress addresses of the cluster, e.g. for allow-lists)."
  value       = aws_eip.nat[*].public_ip
}

output "flow_log_group_name" {
  description = "CloudWatch log group receiving the VPC flow logs."
  value       = aws_cloudwatch_log_group.flow_logs.name
}
