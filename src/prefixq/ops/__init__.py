"""Operations on a deployment: statistics, queue views, health checks, recovery (`reclaim`,
`dead`)."""
