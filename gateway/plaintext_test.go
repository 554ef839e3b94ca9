package gateway

import "testing"

// TestClassifyFirst: the first bytes of a connection tell plaintext HTTP
// from TLS (and anything else) as soon as they can, from one byte on.
func TestClassifyFirst(t *testing.T) {
	for _, tc := range []struct {
		first string
		want  int
	}{
		{"", firstUndecided},
		{"\x16\x03\x01\x02\x00", firstOther}, // a TLS ClientHello record
		{"\x16", firstOther},
		{"G", firstUndecided},
		{"GET / HTTP/1.1\r\n", firstHTTP1},
		{"OPTIONS * HTTP/1.1\r\n", firstHTTP1},
		{"POST", firstUndecided},
		{"PRI * HTTP/2.0\r\n", firstUndecided}, // part of the HTTP/2 preface
		{"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", firstH2C},
		{"PRI * HTTP/1.1\r\n", firstHTTP1}, // not the preface: a request line
		{"get / HTTP/1.1", firstOther},
		{"ABCDEFGHIJKL", firstOther}, // longer than any method
		{" GET", firstOther},
		{"SSH-2.0-OpenSSH", firstOther},
	} {
		if got := classifyFirst([]byte(tc.first)); got != tc.want {
			t.Errorf("classifyFirst(%q) = %d, want %d", tc.first, got, tc.want)
		}
	}
}
