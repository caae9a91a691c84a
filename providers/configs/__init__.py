"""The vendor providers' configuration and options models, apart from their SDKs.

Each module here imports pydantic and corral alone, so that ``corral providers schema``, the
admin api and the console can render a provider's form where its SDK is not installed; the
provider's own module re-exports its models. The descriptors (:mod:`corral.providers.descriptors`)
name these modules.
"""
