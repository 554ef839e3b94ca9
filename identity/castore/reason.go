package castore

import (
	"fmt"
	"strings"
)

// reasons are the RFC 5280 revocation reasons (CRLReason) an operator
// may give, by code.
var reasons = map[int]string{
	0: "unspecified",
	1: "keyCompromise",
	2: "caCompromise",
	3: "affiliationChanged",
	4: "superseded",
	5: "cessationOfOperation",
	6: "certificateHold",
	9: "privilegeWithdrawn",
}

// ParseRevocationReason returns the RFC 5280 code of a reason name
// (unspecified, keyCompromise, caCompromise, affiliationChanged,
// superseded, cessationOfOperation, certificateHold, privilegeWithdrawn;
// any case).
func ParseRevocationReason(s string) (int, error) {
	for code, name := range reasons {
		if strings.EqualFold(s, name) {
			return code, nil
		}
	}
	return 0, fmt.Errorf("%w: revocation reason %q: want one of unspecified, keyCompromise, caCompromise, affiliationChanged, superseded, cessationOfOperation, certificateHold, privilegeWithdrawn", ErrRefused, s)
}

// RevocationReasonName is the RFC 5280 name of a reason code ("reason
// <code>" for a code outside the list).
func RevocationReasonName(code int) string {
	if name, ok := reasons[code]; ok {
		return name
	}
	return fmt.Sprintf("reason %d", code)
}
