"""The kopf operator that turns an InklingFleet into the workloads that serve it (`cascadia.operator`)."""

GROUP = "cascadia.dev"
VERSION = "v1alpha1"
PLURAL = "inklingfleets"
KIND = "InklingFleet"
