"""The shared session directory of several gateways (issue 20, docs/deploy.md "Scale-out").

One Redis holds, for each live session, which gateway owns it (its address), which Triton replica holds its KV
and its resume-journal position, plus a copy of what a resume needs (`replica.py`: the journal's exact bytes, the
token digests, the session's state and config); each gateway holds a lease key that it refreshes while it runs. A
resume that reaches a gateway which does not own the session is relayed, frame for frame, to the owner
(`relay.py`), which runs the whole resume procedure itself. A session whose owner's lease has run out (the
gateway died) is adopted by the gateway the resume reaches (`adopt.py`): rebuilt from the copy, bound to its
Triton sequence again and resumed there, the replay byte for byte, the old token refused, as on one gateway
(before the lease runs out the resume gets `runtime_resume_failed`: the owner does not answer). One nobody adopts
within the resume grace is swept by one gateway (`sweep.py`), which closes its Triton sequence and forgets it.
"""
