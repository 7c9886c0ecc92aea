"""The network and its search: the Transformer (model, reading top to bottom like the paper),
how it computes while decoding (kernels), greedy and beam search over a step function (search,
maxima), ensembles (ensemble), alignments from the cross-attention (alignment), lexically
constrained search (constraints), lexical shortlists and a batch's candidates (shortlist,
candidates).

Imports: common, config, data.
"""
