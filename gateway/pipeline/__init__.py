"""The gateway's one request path, shared by the gRPC and the OpenAI fronts.

A front parses its wire request into a :class:`~gateway.request.GenerateInput`
(:meth:`Pipeline.parse`) and renders the :class:`GenerateEvent` s that
:meth:`Pipeline.generate` yields. The stages, each a module of this package:

1. preprocess (``images``, ``videos``, ``preprocess``): URLs fetched; each image's header
   read, its resize planned and its file digested; ``CacheService/Lookup`` by file digest
   (an exact hit is never decoded); the others decoded once (EXIF-upright RGB), resized
   (``image_grid_thw``), keyed and described; videos decoded, sampled and resized;
2. cache lookup (``cache``): ``CacheService/Lookup`` by pixel key, exact then similarity;
3. encode (``encode``): ``EncoderService/Encode`` for the misses; the encoder holds their
   embeddings and answers refs (``vlcommon.handoff``); the put to the cache runs beside the
   decode;
4. decode (``decode``): ``DecoderService/Generate`` with the messages and one ref per
   image; the decoder reads each from its holder and streams tokens. When a held ref is
   gone, every image is encoded again and the decode runs once more, within the deadline.

Nothing is yielded before the decoder's first token, so every bad input fails with a
status before a stream starts. Closing the generator (a client that went away) cancels the
decoder call, which aborts the vLLM request. Each hop gets the time left to the deadline.
No embedding byte passes through the gateway: hits and encodes come back as refs.

Usage::

    pipeline = Pipeline(settings, spec, revision, forbidden_tokens, downstream)
    await pipeline.warm_up()
    request = pipeline.parse(grpc_request, Deadline.of(context))
    async for event in pipeline.generate(request):
        ...
"""

from gateway.pipeline.core import Downstream, Pipeline
from gateway.pipeline.events import GenerateEvent

__all__ = ["Downstream", "GenerateEvent", "Pipeline"]
