'use client'

import { useState } from 'react'

// A client component: the button counts only once the page's JavaScript
// has loaded and hydrated it.
export default function Counter() {
  const [count, setCount] = useState(0)
  return (
    <button type="button" onClick={() => setCount((c) => c + 1)}>
      count is {count}
    </button>
  )
}
