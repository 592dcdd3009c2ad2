"""The exceptions packtools raises for conditions a user can fix. The CLI prints their message as one
line and exits non-zero; anything else escaping is a bug and keeps its traceback."""


class ExpertpackError(Exception):
    """Base class: the message alone must tell the user what is wrong and what to do."""


class SourceError(ExpertpackError):
    """The source GGUF (or one shard of a split set) is missing, truncated, malformed or inconsistent."""


class ClassifyError(ExpertpackError):
    """The tensors of a model cannot be split into routed experts and trunk with certainty."""


class DenseModelError(ClassifyError):
    """The model has no routed-expert tensors: there is nothing to stream."""


class OutputExistsError(ExpertpackError):
    """The output directory already holds a pack or unrelated files and --force was not given."""


class DiskSpaceError(ExpertpackError):
    """The output filesystem has too little free space for the pack, the trunk and the safety margin."""


class ManifestError(ExpertpackError):
    """manifest.json is missing, malformed, or does not describe the pack beside it."""


class BuildLockedError(ExpertpackError):
    """Another build is writing into the same output directory."""
