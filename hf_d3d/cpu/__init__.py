"""CPU machinery, applied by the library's entry points and never part of the Hub remote code: few-row linears for
verify forwards (``skinny``) and fp16-stored drafter weights (``fp16_weights``). Neither changes the output."""
