"""The static text that follows the record in the field-early layout (fixed, deterministic).

An agent's prompt in the shape the paper's hit-rate benchmark uses: a state block at the top
(the record), then long text that does not depend on it: reply instructions, an operations
handbook, a prior conversation. The fast mode keeps only the first sections.
"""

from __future__ import annotations

SECTIONS: tuple[str, ...] = (
    """Instructions for this reply. You are the operations assistant of a mid-sized online \
retailer and lender. The record at the top of this prompt is the current state of the case \
you are handling; it was copied from the case system when this conversation started. Read \
the rule, the handbook and the conversation below, then answer the question at the end with \
a single word, yes or no. Do not explain the answer, do not ask follow-up questions and do \
not repeat the record. If the handbook and the rule disagree, the rule wins.""",
    """Operations handbook, section 1: scope. This handbook applies to every case handled by \
the operations desk: refunds, account access, same-day shipping and small loans. Each case \
is decided from the fields of its record and the written rule for that kind of case. Agents \
do not make exceptions on their own; an exception needs the written approval of a team lead, \
and the approval must be attached to the case before the decision is sent. Decisions are \
final once sent, except when the record was wrong at the time of the decision, in which case \
the case is reopened and decided again from the corrected record.""",
    """Operations handbook, section 2: verifying a request. Before deciding, confirm that the \
person in the conversation is the person named in the record or is authorised to act for \
them. Ask for the case number and one detail of the record that was not shown to them, such \
as the amount or the date. Never read out the full record. If the person cannot confirm, \
explain that the case cannot be discussed and offer to send a verification link to the \
address on file. Verification links expire after twenty-four hours and can be resent twice.""",
    """Operations handbook, section 3: privacy and data handling. Records contain personal \
data. Copy only the fields a task needs, never paste a record into an external tool, and \
delete temporary notes at the end of the shift. Payment details are masked in the case \
system; if a customer reads out a full card number, stop them politely and note in the case \
that a card number was disclosed. Requests to export or erase personal data are forwarded to \
the privacy team within one working day and are not handled by the operations desk.""",
    """Operations handbook, section 4: tone and escalation. Be brief, polite and concrete. \
State the decision first, then what happens next and when. Do not blame carriers, \
warehouses or other teams by name. Escalate to a team lead when a customer mentions legal \
action, when the same case has been reopened three times, when the amount is above the \
desk's limit, or when the record and the customer's account of events disagree in a way the \
agent cannot resolve from the case history. Escalations are answered within four hours.""",
    """Operations handbook, section 5: record keeping. Every decision is logged with the \
fields it was based on, the rule that was applied, the time and the agent's identifier. \
Corrections to a record are never made by editing earlier log entries; a correction is added \
as a new entry that names the field, the new value and the reason. Audits sample one case in \
fifty each week and check that the logged fields match the record at the time of the \
decision. Cases with missing log entries are reopened and reviewed by a team lead.""",
    """Operations handbook, section 6: changes during a case. A record can change while a \
case is open: a parcel is found, a role is revised, stock arrives or a risk review finishes. \
The case system then sends a state update naming the field and its new value. A state update \
overrides the value shown in the record for the rest of the case. Decide from the updated \
value, log the update with the decision, and tell the customer that the decision reflects the \
latest information. Never decide from a value that a later update has replaced.""",
    """Prior conversation.
Customer: Hello, I am writing about my case. I got an email saying it was being reviewed.
Agent: Thank you for getting in touch. Could you give me the case number, please?
Customer: Yes, it is the one in the email, ending in 4417.
Agent: Thank you. To confirm it is you, could you tell me the date on the case?
Customer: I think it was opened at the start of the month, on a Tuesday.
Agent: That matches. I can see the case and the record that goes with it.
Customer: Good. I would like to know what the decision is and how long it will take.
Agent: I understand. Decisions are made from the record and the written rule for this kind \
of case, so I will check the record first and come back to you with an answer.
Customer: Fine. I have been waiting for a while, so a quick answer would help.
Agent: Of course. I will give you the decision in this conversation.""",
)

FAST_SECTIONS = 3
"""Sections kept by the fast mode (about 350 tokens instead of about 1,000)."""


def body(sections: int | None = None) -> str:
    """The first ``sections`` sections (all by default), separated by blank lines."""
    return "\n\n".join(SECTIONS[:sections])
