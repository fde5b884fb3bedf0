"""autopar."""

from autopar.errors import AutoparError, CaptureError
from autopar.ir.hint import hint
