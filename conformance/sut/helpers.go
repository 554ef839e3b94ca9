package main

import "encoding/pem"

// pemBlock is the DER of the first PEM block of b, or b itself when it is
// not PEM.
func pemBlock(b []byte) []byte {
	if p, _ := pem.Decode(b); p != nil {
		return p.Bytes
	}
	return b
}
